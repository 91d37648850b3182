"""Services every face uses: the engine (engine_service), store, settings, discovery, hub
download, BLAS, hosts, text safety and error lines. No module here imports a face."""
