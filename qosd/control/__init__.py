"""The SLO loop, by concern.

- ``law``: the control law, pure: from each class's latency evidence, cut, grow or
  hold the pool's admitted rate, and how far (docs/control.md);
- ``leader``: the loop one elected daemon runs: evidence from the fleet's windows,
  the law, the store's ``adjust``, restores after a store came back empty;
- ``windows``: latency windows and objectives: compliance, percentiles, trends;
- ``prefill``: how long a prompt's prefill takes, learned from reports, and which
  prompts would stall the top class beyond what it absorbs.
"""
