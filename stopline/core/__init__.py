"""The pure core: what both sides of the workflow boundary share.

Contracts (:mod:`.contracts`), policies (:mod:`.policies`), refusal
disposition and receipts (:mod:`.refusal`), the sub-task tools' argument
models (:mod:`.task_tools`) and the search-attribute keys
(:mod:`.search_attributes`). Nothing here does I/O, reads a clock or the
environment: workflow code imports all of it inside the sandbox, and
``tests/test_workflow_determinism.py`` scans every module of it. Nothing here
imports from a layer above (workflows, activities, worker, CLI).
"""
