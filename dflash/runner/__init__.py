"""The program: the process around one job (launch.py's checks, rank, status, signals) and the job itself
(build, resume, train, finish). `entry.py` is what launch.py calls; `run.py` reads as the training job in one
sitting."""
