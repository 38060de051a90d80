"""``python -m stopline.worker``: run a worker (see :mod:`stopline.worker.main`)."""

from stopline.worker.main import main

main()
