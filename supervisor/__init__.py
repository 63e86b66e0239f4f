"""The supervisor: desired state, membership, placement, replica lifecycle and the front door."""
