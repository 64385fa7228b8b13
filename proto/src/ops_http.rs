//! The operator HTTP endpoint every Strata service serves: `/metrics` (Prometheus text) and
//! `/health`.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The process-wide Prometheus recorder. Several services in one process (standalone mode,
/// the test harness) share it, so it is installed once.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (an embedding application's): then
            // our handle renders nothing, which is better than failing to start.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// A health check: `Ok(())` is healthy, `Err(reason)` answers 503 with the reason.
pub type HealthCheck = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Binds `addr` and serves `/metrics` and `/health` until the task is aborted.
pub async fn serve(addr: SocketAddr, health: HealthCheck) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let handle = metrics_handle();
    let app = Router::new().route("/metrics", get(move || std::future::ready(handle.render()))).route(
        "/health",
        get(move || {
            let answer = match health() {
                Ok(()) => (StatusCode::OK, "ok\n".to_string()),
                Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
            };
            std::future::ready(answer)
        }),
    );
    let task = tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::warn!(?err, "ops http server stopped");
        }
    });
    Ok((local, task))
}
