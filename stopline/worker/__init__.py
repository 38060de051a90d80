"""The worker layer: connecting to Temporal, building workers, the worker process.

Above the core, the workflows and the activities; below the CLI. Modules:
:mod:`.runtime` (connect, build workers, the embedded dev server),
:mod:`.codec` (payload encryption), :mod:`.telemetry` (metrics, tracing),
:mod:`.main` (the ``stopline-worker`` process).
"""
