//! A shutdown signal that many tasks can wait on.

use tokio::sync::watch;

/// Cloneable handle: [`Shutdown::trigger`] once, every [`Shutdown::wait`] resolves.
#[derive(Debug, Clone)]
pub struct Shutdown {
    tx: watch::Sender<bool>,
    rx: watch::Receiver<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// A signal that has not fired.
    pub fn new() -> Self {
        let (tx, rx) = watch::channel(false);
        Shutdown { tx, rx }
    }

    /// Fires the signal.
    pub fn trigger(&self) {
        let _ = self.tx.send(true);
    }

    /// Whether the signal has fired.
    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once the signal has fired.
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|v| *v).await;
    }
}
