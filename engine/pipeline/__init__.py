"""Pipelines: one model split over several engine processes joined by the stage link."""
