"""Study scripts (``python sweeps/<study>.py``) and the machinery they share."""
