"""trainguard.dashboards: what an on-call engineer sees and what pages them.

- :mod:`.grafana`, :mod:`.rules`, :mod:`.rule_tests`, :mod:`.alertmanager`: the Grafana
  dashboards, Prometheus alert rules (with promtool unit tests) and the Alertmanager template,
  generated from the metric contract into the top-level ``dashboards/`` by :mod:`.export`
  (``trainguard dashboards export DIR``); :mod:`.push` uploads the dashboards to Grafana.
- :mod:`.pager`: direct paging from the node agent for the embedded default (no Prometheus).

Submodules are imported on use; only :mod:`.grafana` needs grafana-foundation-sdk and only
:mod:`.push` grafana-client (extra ``trainguard[dashboards]``).
"""
