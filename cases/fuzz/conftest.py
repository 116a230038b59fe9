"""Makes sure the fuzz plugin (profiles, worst-case summary) is active when fuzz tests are collected;
see ``cases/fuzz/plugin.py``."""
from __future__ import annotations

from cases.fuzz import plugin


def pytest_configure(config):
    pm = config.pluginmanager
    if not pm.is_registered(plugin) and not pm.has_plugin("cases.fuzz.plugin"):
        pm.register(plugin, "cases.fuzz.plugin")
