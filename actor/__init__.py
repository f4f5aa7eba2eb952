"""Actors: multi-turn episodes in sandboxes, strict token-in-token-out trajectories.

Modules: ``environments`` (the text environment protocol), ``frozenlake`` and ``swe`` (the two
environments; SWE tasks live in ``tasks/``), ``tokenization`` (tokenizers and the turn template),
``policy`` (the ``Policy`` protocol, ``BatchedSampler`` over the JAX sampler), ``episode``
(``run_episode``/``run_group``), ``sandbox``/``sandbox_server``/``pods`` (isolation), ``runner``
(the actor loop), ``settings``, ``wiring`` and ``cli``; ``labels`` holds the sandbox-pod label
keys the operator imports.

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
