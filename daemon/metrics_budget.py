"""The adaptive draft budget's own figures on /metrics (docs/observability.md), read from the
scheduler's budget at each scrape (nothing on the step loop): what its cost model, routing
model and choices are now, so a run that drafts more or less than expected says why."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from daemon.metrics import PREFIX


class BudgetFigures(Collector):
    """``source()``: the scheduler's DraftBudget now (None without ``draft_budget =
    "adaptive"``: nothing is shown)."""

    def __init__(self, source: Callable[[], object]) -> None:
        self.source = source

    def collect(self):
        figures = GaugeMetricFamily(
            f"{PREFIX}_draft_budget", "The adaptive draft budget's estimates now, by figure: "
            "fixed_ms, row_ms, expert_ms (its step cost model for cost_slots slots, the "
            "slot count most steps had), fitted_steps (the steps the fit has weighed), "
            "persistence, locality, effective_experts, picks_per_row (its routing model), "
            "union_error and step_error (its forecasts' average relative error), "
            "request_weight (the trials a request's acceptance leans on its source's)",
            labels=["figure"])
        choices = CounterMetricFamily(
            f"{PREFIX}_draft_budget_choices", "Drafted slots' verifications by the draft "
            "count the budget chose for them", labels=["drafts"])
        budget = self.source()
        if budget is not None:
            for name, value in budget.figures().items():
                figures.add_metric([name], value)
            for drafts, n in enumerate(budget.chosen):
                if n:
                    choices.add_metric([str(drafts)], float(n))
        yield figures
        yield choices
