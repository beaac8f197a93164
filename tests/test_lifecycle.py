"""A request's phases with the disk cache (pure, no engine)."""

from vllm_kvdisk.core.control import RequestControl
from vllm_kvdisk.core.lifecycle import Phase, RequestState


def state() -> RequestState:
    return RequestState(request=None, scope=None, ns="ns", control=RequestControl())


def test_a_load_goes_new_loading_running_and_a_preempted_request_may_load_again():
    st = state()
    assert st.may_load and st.may_save and not st.computing
    st.admitted(loading=True)
    assert st.phase is Phase.LOADING and not st.may_load and not st.may_save
    st.load_finished()
    assert st.phase is Phase.RUNNING and st.computing and st.may_save
    assert st.may_load  # preempted and back in the queue: the disk may serve it again


def test_a_failed_load_never_loads_again_but_saves_its_recomputed_prefix():
    # vLLM re-queues it to recompute the invalid blocks; from here that looks like a
    # preemption. Offering the disk again repeated the failing load forever.
    st = state()
    st.admitted(loading=True)
    st.load_failed()  # a rank's report; with TP > 1 other ranks may still be loading
    assert st.phase is Phase.LOADING and not st.may_save and not st.computing
    st.load_finished()  # the finished_recving vLLM delivers once every rank sent it
    assert st.phase is Phase.FAILED and not st.may_load
    assert st.may_save and st.computing
    st.load_finished()  # a late duplicate changes nothing
    assert st.phase is Phase.FAILED


def test_admission_without_a_load_drops_the_memo():
    st = state()
    st.memo_key = (0, 100)
    st.admitted(loading=False)
    assert st.phase is Phase.RUNNING and st.memo_key is None and st.may_load
