"""Pipeline parallel: schedules as data (schedules.py), one executor that runs any of them on this rank's stage
(executor.py), and a model of one's own split into stages (split.py)."""
