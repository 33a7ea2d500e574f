"""What a duplicate meets on the worker: the policies (``policies.py``: skip, retry, raise,
coalesce, permits' windows, a parent's release, Redis down), coalesce's one follow-up
(``coalesce.py``), the skip marker and ``skip_info`` (``skips.py``), and what a skip stops
in the canvas around it (``canvas.py``)."""
