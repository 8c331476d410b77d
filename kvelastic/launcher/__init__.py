"""``kvelastic launch``: several vLLM servers on one GPU, planned, checked and supervised.

The launcher sits above everything else: it builds a plan from the command
line or a YAML file (:mod:`~kvelastic.launcher.plan`,
:mod:`~kvelastic.launcher.plan_file`), checks the machine before starting
anything (:mod:`~kvelastic.launcher.checks`), and runs one ``vllm serve`` per
instance under a supervisor (:mod:`~kvelastic.launcher.supervisor`). The
servers find each other through the GPU's shared account, not through it.
"""
