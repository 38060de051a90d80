"""Run a stopline worker: ``python worker.py``.

Against ``TEMPORAL_ADDRESS`` when set, else the embedded dev server (started
if needed). See ``stopline/worker/main.py``.
"""

from stopline.worker.main import main

if __name__ == "__main__":
    main()
