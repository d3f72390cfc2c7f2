"""The toy method's config section (standard library only, like every section)."""
from dataclasses import dataclass

from fastprompt.fields import Section, option


@dataclass
class ToyConfig(Section):
    """The toy method's token term."""

    weight: float = option(0.0, "weight of the toy reconstruction term; 0 = off", ge=0.0, key="toy_weight",
                           identity=True)
    rate: float = option(0.3, "share of each row's tokens the toy term reconstructs", gt=0.0, lt=1.0, key="toy_rate",
                         identity=True)
    log_note: str = option("", "a note for the logs (not part of the run's identity)", key="toy_note",
                           identity=False)

    @property
    def enabled(self) -> bool:
        return self.weight > 0
