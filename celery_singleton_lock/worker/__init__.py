"""The worker's main process: its signal hooks (``hooks.py``: release on every path, the
start-up checks and banner), the main-process skip of a hot key's duplicates
(``mainskip.py``), the reaper of killed pool children (``reaper.py``), and what a worker
refuses at start (``pools.py``, ``scopes.py``). ``import celery_singleton_lock`` connects the
hooks."""
