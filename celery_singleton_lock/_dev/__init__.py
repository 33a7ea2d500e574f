"""Development helpers, not for users: processes in their own session (``process.py``) and
throw-away Redis servers (``server.py``) for the demo, the tests and the benchmarks. Nothing
in the library imports them."""
