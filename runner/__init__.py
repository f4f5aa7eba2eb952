"""The local runner, ``stoker run``: a job's buffer, learner and actors as processes on this
machine (``local``) or the synchronous baseline loop (``sync``, also the operator's colocated
learner pod), with live progress (``progress``) and the run report (``report``)."""
