"""Model families, one file each, written once per backend."""
