"""A node's failure is reported in one line that names its own error, not Ray's wrapper around it."""

from __future__ import annotations

from fedrec_flwr.errors import reply_error_line

RAY_REASON = """<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run() (pid=4242, ip=127.0.0.1, actor_id=abc, repr=<flwr.simulation.ray_transport.ray_actor.ClientAppActor object at 0x7f>)
  File "/venv/lib/python3.11/site-packages/flwr/simulation/ray_transport/ray_actor.py", line 60, in run
    raise ClientAppException(str(ex)) from ex
flwr.client.client_app.ClientAppException:
Exception ClientAppException occurred. Message: Traceback (most recent call last):
  File "/work/plugins/bad_client.py", line 9, in fit_named
    raise RuntimeError("crash in fit (deliberate)")
RuntimeError: crash in fit (deliberate)
'>"""


def test_the_clients_own_error_is_picked_from_rays_reason():
    assert reply_error_line(RAY_REASON) == "RuntimeError: crash in fit (deliberate)"


def test_a_qualified_error_of_ours_keeps_its_message_and_a_plain_reason_is_kept_as_it_is():
    assert (
        reply_error_line("x\nfedrec_flwr.errors.ClientStateError: user-3.npz: unreadable\n")
        == "ClientStateError: user-3.npz: unreadable"
    )
    assert reply_error_line("no reply within round-timeout (20 s)") == "no reply within round-timeout (20 s)"
