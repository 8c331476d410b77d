"""How many empty page groups to keep mapped ahead of need.

Mapping a group costs driver calls; a scheduling step that finds too few
mapped blocks either waits for them or schedules less. So the free queue keeps
a few empty groups mapped in advance, as many as the largest allocation burst
of the last few seconds needed (plus one), never more than its cap, and none
once the engine is idle.
"""

from __future__ import annotations

from collections import deque

BURST_WINDOW_S = 2.0


class BurstPrefetch:
    """The running maximum of recent allocation bursts, turned into a number of groups."""

    def __init__(self, blocks_per_group: int, max_groups: int, window_s: float = BURST_WINDOW_S):
        self.blocks_per_group = blocks_per_group
        self.max_groups = max_groups
        self.window_s = window_s
        self.groups = 1
        self._bursts: deque[tuple[float, int]] = deque()  # decreasing in size: the head is the maximum

    def note(self, now: float, blocks: int) -> int:
        """An allocation of ``blocks`` at ``now``; returns the groups to keep mapped ahead."""
        bursts = self._bursts
        while bursts and bursts[-1][1] <= blocks:
            bursts.pop()
        bursts.append((now, blocks))
        while bursts[0][0] < now - self.window_s:
            bursts.popleft()
        self.groups = min(self.max_groups, -(-bursts[0][1] // self.blocks_per_group) + 1)
        return self.groups

    def clear(self) -> None:
        """Idle: keep nothing ahead until the next allocation."""
        self._bursts.clear()
        self.groups = 0
