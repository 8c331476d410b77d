"""Tensor parallelism: one scheduler deciding which page groups every worker rank maps.

With TP (or any multiprocess executor) each rank owns KV tensors on its own GPU
while the scheduler runs in the engine-core process. The scheduler-side
:class:`~kvelastic.tp.remote_mapper.RemoteMapper` turns the page-aware queue's
map/unmap (and host-tier copy) decisions into numbered commands that ride the
step's ``SchedulerOutput``; each rank's :class:`~kvelastic.tp.rank.RankWorker`
applies them around the forward pass and reports what it mapped on its reply to
the step. A group's blocks are handed out only once every rank has confirmed
it. Everything between ranks and scheduler rides vLLM's own calls: no file,
socket or shared memory of kvelastic's. :class:`~kvelastic.tp.scheduler_side.RankConnection` hands the
scheduler these objects in the roles of :mod:`kvelastic.roles`, the same the
in-process cache fills.
"""
