"""What a call meets beyond its lock: the parts a task's settings select and their lifecycle
(``policy.py``); the gate, which takes the lock and decides a contended call's fate
(``gate.py``), and what carries that fate out (``fates.py``); one module per policy (``skip.py``,
``retry.py``, ``raising.py``, ``coalesce.py``, ``join.py``) and per modifier (``permits.py``,
``rate.py``, ``debounce.py``, ``window.py``, ``publish_dedup.py``); the skip marker and
``skip_info`` (``skips.py``), what a skip stops in the canvas around it (``canvas.py``), and the
copies of a message the library publishes again (``copies.py``)."""
