"""The node agent: facts, calibration, link probes and engine lifecycle on one machine."""
