"""Source mutation of DeepSpeed's own Muon code with Cosmic Ray (``python -m harness mutate --engine
cosmic-ray``): real edits of a private copy of the installed DeepSpeed, judged by the gate's decision
on the cases that execute the edited line.

scope         the one list of functions in scope, resolved to lines from the AST
workspace     the private copy the engine edits, and the run's state folder
selection     the coverage map and which cases can kill a mutant (stdlib only)
coverage_map  recording the map on the ranks (coverage.py)
worker        the engine's test command: judge the mutant in the copy
session       builds the engine's session (runs in the engine's own virtual environment)
equivalents   the curated equivalent mutants (harness/data)
ledger        the judged results (an output under reports/mutation-ledger), so a whole-scope run resumes
report        mutation.html
cli           the ``mutate --engine cosmic-ray`` driver
tree_run      ``--tree``: another DeepSpeed tree's Muon code, judged in that tree's venv

Imports inside functions are deliberate in this package: DeepSpeed must be imported from the mutated
copy, so nothing may import it before ``workspace.use_copy()`` has put the copy first on the path, and
the engine's own environment (session, selection, ledger) has no torch at all.
"""
