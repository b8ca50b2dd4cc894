"""An example deepinfer kernel pack: a fused ``rms_norm`` that overrides cpu_ref's reference one."""
