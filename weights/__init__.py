"""The weight channel: how a trained policy gets from the learner to every sampler.

The product's fourth data path (actors -> buffer -> learner -> **weights** -> rollout servers and
actors). The learner publishes versions (``publish``: every learner process its own shards;
``channel``: a single blob over gRPC or in a shared directory, ``blob_format`` and
``blob_directory``); readers fetch the newest by slice from the learner's processes
(``shard_service`` over gRPC, ``shard_stream`` over a plain byte stream), a shared directory or
bucket (``shard_directory``), or from each other (``shard_relay``, ``relay_source``, arranged by
``relay_registry``); ``device_weights`` hands them over device to device inside one colocated
process. The format and its errors: ``shard_format``, ``errors``; what the gRPC servers share:
``grpc_common``.

Below the learner, the rollout tier and the actors; above the model (whose parameter names it
uses). Nothing here imports training code.
"""
