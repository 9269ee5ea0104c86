"""Run one function per rank in threads (in-process communicators); the first error is re-raised."""
import threading


def run_threads(comms, fn, timeout=60):
    """``[fn(c) for c in comms]``, each call in its own thread; raises the first exception."""
    results, errors = [None] * len(comms), []

    def work(i):
        try:
            results[i] = fn(comms[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return results


def run_ranks(out_dir, feeds, world=2, timeout=120):
    """Every rank of the compiled ``out_dir`` loaded with an in-process communicator of ``world`` ranks and run
    once on ``feeds``, each in its own thread: the ranks' outputs (``load(...).run``'s dicts), in rank order."""
    from shardflow.runtime import load
    from shardflow.runtime.comm import InProcessWorld

    return run_threads(InProcessWorld(world).communicators(), lambda c: load(out_dir, c.rank, c).run(feeds),
                       timeout=timeout)
