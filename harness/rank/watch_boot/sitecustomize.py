"""Put first on ``PYTHONPATH`` by ``python -m harness watch``: every Python process of the watched command
(launcher and ranks) gets the capture installed before the user's code runs (``harness.rank.watch_hook``)."""
from harness.rank import watch_hook

watch_hook.install_from_env()
watch_hook.chain_sitecustomize(__file__)
