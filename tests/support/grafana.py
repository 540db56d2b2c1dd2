"""What Grafana does with a dashboard's Prometheus queries before they reach Prometheus, so a test
can evaluate every panel as Grafana would: template variables (query variables resolved with
label_values(), multi-value and "All" selections), the global interval variables, legends.

Written from Grafana's source:
- packages/grafana-prometheus/src/escaping.ts: interpolateQueryExpr, prometheusRegularEscape,
  prometheusSpecialRegexEscape (the classic behaviour, without the
  prometheusSpecialCharsInLabelValues feature toggle);
- packages/grafana-prometheus/src/datasource.ts: getRateIntervalScopedVariable
  ($__rate_interval = max($__interval + scrape interval, 4 x scrape interval)),
  getRangeScopedVars ($__range, $__range_s, $__range_ms: the time range in whole seconds);
- packages/grafana-prometheus/src/metric_find_query.ts: `label_values(metric, label)` variable
  queries (the label's values on the series the selector matches over the time range);
- public/app/features/templating/template_srv.ts: "All" is the variable's custom allValue
  verbatim when it has one, else every option's value;
- the Prometheus data source's legend.ts (renderLegendFormat): `{{label}}` becomes the
  label's value, or the label's name when the series has no such label.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

ALL = "$__all"
LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\)\s*$")
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
LEGEND = re.compile(r"\{\{\s*(.+?)\s*\}\}")


def regex_escape(value: str) -> str:
    """prometheusSpecialRegexEscape: a value inside a PromQL regex matcher's string literal."""
    value = value.replace("\\", "\\" * 4)
    return re.sub(r"[$^*{}\[\]+?.()|]", lambda m: "\\\\" + m.group(0), value)


def regular_escape(value: str) -> str:
    """prometheusRegularEscape (classic): backslashes and single quotes."""
    return value.replace("\\", "\\\\").replace("'", "\\\\'")


def interpolate_value(values: list[str], var: dict[str, Any]) -> str:
    """interpolateQueryExpr."""
    if not var.get("multi") and not var.get("includeAll"):
        return regular_escape(values[0])
    escaped = [regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


@dataclass
class TimeRange:
    start: float
    end: float
    scrape_interval_s: int  # the data source's "Scrape interval" (timeInterval)
    max_data_points: int = 1000

    @property
    def interval_s(self) -> int:
        """$__interval: the range over the panel's data points, never below the scrape interval."""
        return max(self.scrape_interval_s, math.ceil((self.end - self.start) / self.max_data_points))

    def globals(self) -> dict[str, str]:
        rng = round(self.end - self.start)
        rate = max(self.interval_s + self.scrape_interval_s, 4 * self.scrape_interval_s)
        return {
            "__interval": f"{self.interval_s}s",
            "__interval_ms": str(self.interval_s * 1000),
            "__rate_interval": f"{rate}s",
            "__range": f"{rng}s",
            "__range_s": str(rng),
            "__range_ms": str(rng * 1000),
        }


@dataclass
class Dashboard:
    """A dashboard's variables as a user left them: `selected[name]` is a list of values or ALL."""

    definition: dict[str, Any]
    time: TimeRange
    selected: dict[str, list[str] | str] = field(default_factory=dict)
    options: dict[str, list[str]] = field(default_factory=dict)

    @property
    def variables(self) -> dict[str, dict[str, Any]]:
        return {v["name"]: v for v in self.definition["templating"]["list"] if v["type"] == "query"}

    def value_of(self, name: str) -> str:
        var = self.variables[name]
        sel = self.selected.get(name, ALL)
        if sel == ALL:
            if var.get("allValue"):
                return str(var["allValue"])
            return interpolate_value(self.options[name], var)
        assert isinstance(sel, list)
        return interpolate_value(sel, var)

    def interpolate(self, expr: str) -> str:
        g = self.time.globals()

        def sub(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(2)
            if name in g:
                return g[name]
            if name in self.variables:
                return self.value_of(name)
            return m.group(0)  # not a variable ($datasource is the data source's, not a query's)

        return VARIABLE.sub(sub, expr)

    def resolve_variables(self, label_values: Any) -> None:
        """Resolve every query variable in order (each may use the ones before it);
        `label_values(label, selector)` asks Prometheus."""
        for name, var in self.variables.items():
            m = LABEL_VALUES.match(self.interpolate(var["query"]))
            assert m, var["query"]
            selector, label = m.group(1), m.group(2)
            self.options[name] = sorted(label_values(label, selector))

    def targets(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [(p, t) for p in self.definition["panels"] for t in p.get("targets", [])]


def legend(fmt: str, labels: dict[str, str]) -> str:
    return LEGEND.sub(lambda m: labels.get(m.group(1)) or m.group(1), fmt)
