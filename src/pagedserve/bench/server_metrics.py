"""The server's own latency histograms from its Prometheus /metrics, for one benchmark run.

Scraped before and after the run; the difference holds only the run's requests (given nothing
else used the server meanwhile). Works for any server that names its TTFT histogram
`<prefix>:time_to_first_token_seconds` (ours and vLLM's do).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.histogram import histogram_quantile

TTFT_SUFFIX = "time_to_first_token_seconds"


@dataclass
class Histogram:
    bounds: list[float]  # bucket upper bounds, ascending, the last one +inf
    counts: list[float]  # cumulative count of observations <= each bound
    total: float  # sum of observed values

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        counts = [a - b for a, b in zip(self.counts, earlier.counts, strict=True)]
        return Histogram(self.bounds, counts, self.total - earlier.total)

    def quantile(self, q: float) -> float | None:
        """Estimated as Prometheus' histogram_quantile: linear within the bucket."""
        return histogram_quantile(self.bounds, self.counts, q)

    def bucket_counts(self) -> list[float]:
        """Observations per bucket (not cumulative)."""
        return [b - a for a, b in zip([0.0, *self.counts[:-1]], self.counts, strict=True)]


def scrape_ttft(client: httpx.Client, base_url: str) -> Histogram | None:
    """The server's TTFT histogram summed over its label sets, or None if it exports none."""
    try:
        response = client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    buckets: dict[float, float] = {}
    total = 0.0
    for family in text_string_to_metric_families(response.text):
        if family.type != "histogram" or not family.name.endswith(TTFT_SUFFIX):
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    if not buckets:
        return None
    bounds = sorted(buckets)
    return Histogram(bounds, [buckets[b] for b in bounds], total)
