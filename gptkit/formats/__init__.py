"""Model file formats: each module reads and writes one format and imports no other."""
