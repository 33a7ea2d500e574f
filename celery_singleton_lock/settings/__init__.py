"""Settings: the table of every ``singleton_*`` setting (``table.py``), reading it for a task
or a beat (``options.py``), the broker as Celery resolves it (``broker.py``), the spellings of
celery-singleton and celery-once (``legacy.py``), and the lock URL's password hidden where
Celery prints the configuration (``masking.py``)."""
