"""Train engines (`fsdp.FSDPEngine`, `megatron.MegatronEngine`) and inference engines
(`local.LocalInferenceEngine`, `remote.RemoteSGLangEngine`, and `server`, our SGLang-protocol
server). `areal_lite.kit.make_train_engine` picks the train backend from the config's ``backend``
field, so swapping backends is one config line."""
