"""What the benchmark scripts share, one thing a module: their output (`payload`), `timing`, the
`profile`, a free port (`ports`), the reader of streamed answers (`sse`), the overload client
(`lean_http`), child servers (`server_process`), the GPU check's parts (`check_rows`, `gpu_paths`,
`hf_compat`, `random_model`, `serve_leg`) and the soak's (`soak_faults`, `soak_report`,
`soak_traffic`)."""
