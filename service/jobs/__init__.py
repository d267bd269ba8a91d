"""Verification and profiling jobs: one protocol (``backend.JobBackend``), two ways to run them.

- ``local.LocalRunner``: threads of the API process run the jobs one at a time (timings must not overlap), from a
  bounded queue; the default with a SQLite store.
- ``queue.QueuedJobs``: the API puts each job on a procrastinate queue of its device kind, and ``multicomposite
  worker`` processes run them (``worker.Worker``, which also reaps stale workers' jobs: ``reaper.Reaper``); the
  default with a PostgreSQL store.

``startup.job_backend`` picks one when the app starts; the routers only call the protocol. Either way the store's
``jobs`` table is the record the API and the dashboard read, what a job does is ``work.make_job_work``, and running
one job (its progress writes, its end, its retries while the store refuses a write) is ``running``. Device kinds
(``cpu``, ``cuda:NAME``) and their queues are ``kinds``.
"""
