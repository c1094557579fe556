"""The step contract at the centre of labs 01, 05, 07 and 08: what a step is (``contract``),
loading the one a lab's ``step`` parameter names and refusing a bad one (``load``), perflab's own
MMDiT as one registered step (``mmdit``) and steps of models no one here wrote (``examples``)."""

#: Folders (os.pathsep-separated) a step factory's package is imported from, besides sys.path and
#: the working directory; ``perflab run`` and ``make lab`` set it (kept free of torch: the CLI reads it).
STEP_PATH_ENV = "PERFLAB_STEP_PATH"
