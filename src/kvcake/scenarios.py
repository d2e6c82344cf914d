"""The two ways a compressed prompt is used, which pick CAKE's temperature sets: ``question``
(question-aware: the compressed prompt ends with its question) and ``context`` (a document
compressed alone, asked about later). See ``kvcake.temperatures``."""

from __future__ import annotations

from dataclasses import dataclass

from .defaults import SCENARIOS


def check_scenario(value: object) -> str:
    """``value`` if it names a scenario (:data:`SCENARIOS`), else a ValueError naming the fix."""
    if value not in SCENARIOS:
        raise ValueError(
            f"scenario must be 'question' (the compressed prompt ends with the question) or 'context' "
            f"(a document compressed alone, asked about later), got {value!r}"
        )
    return value


@dataclass(frozen=True)
class Scenario:
    """Which temperature set a cache uses (``name``, one of :data:`SCENARIOS`) and ``why``: the
    entry point that implied it, or that it was given."""

    name: str
    why: str

    def __post_init__(self) -> None:
        check_scenario(self.name)

    @classmethod
    def pick(cls, given: str | Scenario | None, default: str, entry: str) -> Scenario:
        """``given`` if set (a :class:`Scenario` is kept as it is), else ``default`` implied by ``entry``."""
        if isinstance(given, Scenario):
            return given
        if given is not None:
            return cls(check_scenario(given), f"scenario={given!r} given")
        return cls(default, entry)


QUESTION_DEFAULT = Scenario(
    "question", "a KVCakeCache for model.generate compresses the prompt with its question"
)
