"""Actors: multi-turn episodes in sandboxes, strict token-in-token-out trajectories.

Modules: ``environments`` (the text environment protocol), ``frozenlake`` and ``swe`` (the two
environments; SWE tasks live in ``tasks/``), ``policy`` (``BatchedSampler`` over the JAX sampler),
``episode`` (``run_episode``/``run_group``), ``sandbox`` (what an episode talks to; inline
environments), ``process_sandbox``/``sandbox_server``/``pods`` (isolation), ``runner`` (the actor
loop), ``settings``, ``wiring`` and ``cli``. Tokenization, the turn template and the ``Policy``
protocol are in ``stoker.conversation``; the sandbox-pod label keys in ``stoker.labels``.

Running episodes in-process (the local runner's synchronous baseline)::

    settings = ActorSettings.from_spec(spec, actor_id="local")
    interface = text_interface(spec)                  # tokenizer + turn template
    policy = make_policy(settings)                    # BatchedSampler over a Sampler
    envs = environment_factory(settings)              # per the spec's sandbox kind
    group = await run_group(policy, envs, interface, task_id, settings.group_size,
                            limits=settings.limits, seed=step)
    await policy.load_weights(flat, version)          # after a training step
    await close_factory(envs)                         # stops a process factory's zygote

Kept import-light: nothing here imports JAX until a sampler is built.
"""
