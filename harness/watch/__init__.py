"""``python -m harness watch``: a user's own training command, run unchanged with the capture installed in
every rank (``harness.rank.watch_hook``), its first optimizer steps judged afterwards by the harness's
own oracle and decision (``harness.watch.judge``)."""
