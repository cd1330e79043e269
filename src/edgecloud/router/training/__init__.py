"""The router's offline half: task suites, labelling, grading sandboxes, fitting and evaluation.

``tasks`` (the labelled suites and how answers are graded), ``corpus`` (the development corpus
the defaults are chosen on, by task family), ``label`` (measured edge and cloud outcomes),
``evaluate`` (APGR, CPT, curves), ``fit`` (the learned scorer) and ``cascade_fit`` (the cascade's
confidence check). Only the CLI and the benchmarks import this package; the request path reads
what it produced (fitted files under ``router/data``) through :mod:`edgecloud.router.scorers`
and :mod:`edgecloud.router.cascade`.
"""
