"""Services every face uses: store, settings, discovery, hub download, BLAS, hosts,
text safety and error lines. No module here imports a face."""
