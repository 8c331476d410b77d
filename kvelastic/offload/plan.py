"""The host tier's plan for one engine: what it runs, chosen from where the engine's KV cache lives.

Three facts, read once when the scheduler attaches, decide every choice:

- whether the KV cache is in the scheduler's process (one GPU, the uniprocess
  executor) or on worker ranks (tensor or pipeline parallelism, the
  multiprocess executor);
- whether a load's completion can be known while compute goes on: a CUDA event
  in this process, or the ranks' reports on the steps' replies;
- whether vLLM made a KV connector: asynchronous loads ride the scheduler's
  connector seam, which is then vLLM's.

What follows from them, and why:

- **Stores.** With the cache in process, blocks are copied to the host once
  computed, beside the forward passes (write-through), on a stream of their
  own through a staging buffer of their own: an eviction then finds its copy
  made and costs no copy, the step's loads never queue behind a store, and the
  stores' SMs only gather at device-memory speed while the copy engines write
  the host. On ranks, blocks are copied as they leave the GPU (eviction): a
  rank has one copy stream, which write-through's stores would share with the
  loads its forward pass waits for.
- **Loads.** Wherever a load's completion can be known beside compute and no
  vLLM connector holds the seam, a request's host-tier run loads while the
  request waits and the others compute; a request alone in an idle engine
  loads in front of the step, where nothing would hide the copy and the map of
  one page group overlaps the copy of the last. Elsewhere, hits load in front
  of the step.
- **Loads nothing waits for**, with the cache in process, go through a
  staging buffer of their own, for the same reason as the stores: they run
  beside compute.
- **Long runs in pieces.** Where page groups are mapped in this process, a run
  of host hits at least two page groups long loads a group at a time while
  vLLM looks the blocks up, each copy beside the next group's mapping.

The measurements behind these choices are in docs/offload.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostPlan:
    """What the host tier runs in one engine (:func:`host_plan` makes it)."""

    #: The KV cache is in the scheduler's process (else on worker ranks).
    cache_in_process: bool
    #: Blocks are stored once computed, beside the forward passes (else as they leave the GPU).
    write_through: bool
    #: Write-through's stores run on a stream and through a staging buffer of their own.
    stores_beside: bool
    #: Host hits load while their request waits (a request alone in an idle engine: in front of the step).
    loads_beside_compute: bool
    #: Loads nothing waits for go through a staging buffer of their own.
    staged_loads: bool
    #: A long run of host hits loads a page group at a time, beside the next group's mapping.
    load_pieces: bool
    #: Why hits load in front of the step; None where they load beside compute.
    loads_in_front_because: str | None = None

    def describe(self) -> str:
        """The plan in one line, for the log."""
        where = "in this process" if self.cache_in_process else "on worker ranks"
        parts = [f"KV cache {where}"]
        if self.write_through:
            beside = ", on a stream and staging buffer of their own" if self.stores_beside else ""
            parts.append(f"blocks stored once computed{beside}")
        else:
            parts.append("blocks stored as they leave the GPU")
        if self.loads_beside_compute:
            staged = ", through a staging buffer of their own" if self.staged_loads else ""
            parts.append(f"hits load while their request waits{staged} (in front of the step when it is alone)")
        else:
            parts.append(f"hits load in front of the step ({self.loads_in_front_because})")
        if self.load_pieces:
            parts.append("long runs load a page group at a time")
        return "; ".join(parts)


def host_plan(*, cache_in_process: bool, loads_reported: bool, vllm_connector: str | None) -> HostPlan:
    """The plan for an engine whose KV cache is in the scheduler's process (``cache_in_process``) or on
    worker ranks; ``loads_reported``: a load's completion can be known beside compute; ``vllm_connector``:
    the class name of the KV connector vLLM made, or None."""
    if vllm_connector is not None:
        in_front: str | None = f"vLLM's KV connector {vllm_connector} holds the seam that loads beside compute ride"
    elif not loads_reported:
        in_front = "the worker ranks do not report loads on the steps' replies"
    else:
        in_front = None
    return HostPlan(cache_in_process=cache_in_process, write_through=cache_in_process,
                    stores_beside=cache_in_process, loads_beside_compute=in_front is None,
                    staged_loads=cache_in_process, load_pieces=cache_in_process, loads_in_front_because=in_front)
