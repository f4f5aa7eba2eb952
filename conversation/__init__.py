"""What actors, the rollout tier and the learner share about a conversation: its tokenization
(``tokenization``: the environment's tokenizer, the turn template, the tokens a policy may sample),
chat templates as Hugging Face tokenizers ship them (``chat_template``), and what one sampled turn
is (``policy``: ``Sampled``, ``PolicyError``, the ``Policy`` protocol episodes sample from).

Import-light: no JAX, no gRPC; below the model, the weight channel and every component.
"""
