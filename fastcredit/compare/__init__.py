"""``python -m fastcredit.compare``: every method on the same seeds, warm start and held-out questions,
resumable runs (``runs``) and their report (``report``)."""
