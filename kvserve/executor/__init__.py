"""The executor seam between the engine and the model.

The engine turns each scheduled step into a plain, picklable ``StepInput`` (``builder``) and
hands it to an executor, which returns a ``StepOutput`` (``step``). ``UniProcExecutor`` runs the
model in this process; ``MultiprocExecutor`` runs one worker process per rank of a tensor-
(and pipeline-) parallel group (``worker``). Import the submodules directly.
"""
