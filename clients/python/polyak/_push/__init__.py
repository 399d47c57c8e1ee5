"""The parts of a :class:`~polyak.Pusher`, each on its own thread.

::

    training thread ──push──► PushQueue ──► CopyThread (deferred parameter copies)
                                  │
                                  ▼
                               Sender: Encoding ──► Connection slot ──► server

- :mod:`.queue`: :class:`PushQueue`, the bounded queue of filled host
  bodies and their pool, with the one lock every part waits on, and the
  failure kept for the training thread.
- :mod:`.copier`: :class:`CopyThread`, the deferred parameter copies.
- :mod:`.mirror`: the ``polyak-bgz`` codec and the client's copy of the
  server's mirror, for keyframes and XOR or quantised deltas with error
  feedback.
- :mod:`.encoding`: what a body becomes on the wire (as is, zstd, or the
  codec and deltas of :mod:`.mirror`); runs on the sender's thread, never
  the training thread's.
- :mod:`.sender`: :class:`Sender`, which takes bodies in step order,
  encodes them and PUTs them on its connection slots (``Polyak-Prev-Step``
  for pipelining) with retries.
- :mod:`.stats`: the counters and :class:`PushStats`.

None of them imports :mod:`polyak.pusher`; the pusher wires them together.
"""
