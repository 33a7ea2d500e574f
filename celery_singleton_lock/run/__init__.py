"""What every run of a SingletonTask holds and leaves, whatever decides its fate: the task
logger (``log.py``), the call as Celery shows it (``callrepr.py``), the lock handle
(``handle.py``), what the renewer reports (``events.py``), how a run ends and the records it
leaves (``completion.py``), and the retry hand-over (``handover.py``)."""
