"""All I/O of stopline: sampling (model calls), tools, ledger writes.

Activities are thin adapters; the workflow decides. Nothing here is imported
by workflow code except through activity *names* (see
``stopline.core.contracts``).
"""
