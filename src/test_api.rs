//! What the in-process tests of several modules share: the answers of a mock API server
//! (tower-test).

/// An HTTP answer of `status` carrying `body` as JSON, as the API server sends one.
pub fn json_response(status: u16, body: &serde_json::Value) -> http::Response<kube::client::Body> {
    http::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(kube::client::Body::from(
            serde_json::to_vec(body).expect("json"),
        ))
        .expect("response")
}
