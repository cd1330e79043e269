// EdgeCloudBridge.kt — the host side of the edgecloud bridge protocol (documentation; not built here).
//
// One JSON-RPC 2.0 object per line. Requests go out with a fresh id; one reader thread
// dispatches every line that comes back: `chat.delta` / `models.pull.progress` notifications
// by `params.id`, responses by `id`. Message shapes: `edgecloud bridge schema`.
//
// Two transports:
//   - ProcessTransport: desktop JVM, or Android with a bundled Python executable; spawns
//     `edgecloud bridge --stdio`.
//   - ChaquopyTransport: Android with Chaquopy; `Bridge.handle(line, emit)` in-process.

package dev.edgecloud.bridge

import org.json.JSONArray
import org.json.JSONObject
import java.io.BufferedReader
import java.io.InputStreamReader
import java.io.OutputStreamWriter
import java.util.concurrent.CompletableFuture
import java.util.concurrent.ConcurrentHashMap
import java.util.concurrent.atomic.AtomicInteger

class BridgeException(val code: Int, message: String, val data: JSONObject?) : Exception(message)

interface BridgeTransport {
    /** Called with each line the bridge emits (on a background thread). */
    var onLine: (String) -> Unit
    fun send(line: String)
    fun close()
}

class EdgeCloudBridge(private val transport: BridgeTransport) {
    private class Pending(val onNotification: (JSONObject) -> Unit, val result: CompletableFuture<JSONObject>)

    private val nextId = AtomicInteger()
    private val pending = ConcurrentHashMap<Int, Pending>()

    init {
        transport.onLine = ::dispatch
    }

    /** Stream a chat: [onDelta] gets each piece of text; the future the final result (or -32800 after [cancel]). */
    fun chat(
        messages: List<Pair<String, String>>,
        maxTokens: Int? = null,
        onDelta: (String) -> Unit,
    ): Pair<Int, CompletableFuture<JSONObject>> {
        val params = JSONObject().put("messages", JSONArray(messages.map { (role, content) ->
            JSONObject().put("role", role).put("content", content)
        }))
        maxTokens?.let { params.put("max_tokens", it) }
        return call("chat.create", params) { note -> onDelta(note.getString("delta")) }
    }

    /** Stop a running chat; its own future then fails with code -32800. */
    fun cancel(requestId: Int) = call("chat.cancel", JSONObject().put("id", requestId)).second

    fun listModels(): CompletableFuture<JSONObject> = call("models.list", JSONObject()).second

    /** Answer `shutdown`, then let the transport go (a spawned bridge exits 0). */
    fun shutdown(): CompletableFuture<JSONObject> =
        call("shutdown", JSONObject()).second.whenComplete { _, _ -> transport.close() }

    fun call(
        method: String,
        params: JSONObject,
        onNotification: (JSONObject) -> Unit = {},
    ): Pair<Int, CompletableFuture<JSONObject>> {
        val id = nextId.incrementAndGet()
        val future = CompletableFuture<JSONObject>()
        pending[id] = Pending(onNotification, future)
        val request = JSONObject().put("jsonrpc", "2.0").put("id", id).put("method", method).put("params", params)
        transport.send(request.toString())  // org.json escapes newlines: always one line
        return id to future
    }

    private fun dispatch(line: String) {
        val message = runCatching { JSONObject(line) }.getOrNull() ?: return
        if (message.has("method")) {  // a notification: params.id names the request
            val params = message.getJSONObject("params")
            pending[params.optInt("id")]?.onNotification?.invoke(params)
            return
        }
        if (message.isNull("id")) return  // a line we sent was not readable
        val entry = pending.remove(message.getInt("id")) ?: return
        val error = message.optJSONObject("error")
        if (error != null) {
            entry.result.completeExceptionally(
                BridgeException(error.getInt("code"), error.getString("message"), error.optJSONObject("data"))
            )
        } else {
            entry.result.complete(message.optJSONObject("result") ?: JSONObject())
        }
    }
}

/** Spawns `edgecloud bridge --stdio`; closing stdin cancels in-flight requests and ends it with 0. */
class ProcessTransport(command: List<String> = listOf("edgecloud", "bridge", "--stdio")) : BridgeTransport {
    override var onLine: (String) -> Unit = {}
    private val process = ProcessBuilder(command).redirectError(ProcessBuilder.Redirect.INHERIT).start()
    private val writer = OutputStreamWriter(process.outputStream, Charsets.UTF_8)

    init {
        Thread({
            BufferedReader(InputStreamReader(process.inputStream, Charsets.UTF_8)).useLines { lines ->
                lines.forEach { onLine(it) }
            }
        }, "edgecloud-bridge-reader").apply { isDaemon = true }.start()
    }

    @Synchronized
    override fun send(line: String) {
        writer.write(line)
        writer.write("\n")
        writer.flush()
    }

    override fun close() = writer.close()
}

/**
 * Chaquopy: Python runs in the app process. A three-line Python module in the app
 * (src/main/python/bridge_adapter.py) turns the Kotlin sink into the `emit` callable:
 *
 *     from edgecloud.bridge import Bridge
 *     def handle(bridge, line, sink):
 *         bridge.handle(line, sink.accept)
 */
class ChaquopyTransport(edgeModel: String) : BridgeTransport {
    override var onLine: (String) -> Unit = {}
    private val python = com.chaquo.python.Python.getInstance()
    private val bridge = python.getModule("edgecloud.bridge").callAttr("Bridge", com.chaquo.python.Kwarg("edge_model", edgeModel))
    private val adapter = python.getModule("bridge_adapter")
    private val sink = java.util.function.Consumer<String> { onLine(it) }

    override fun send(line: String) {
        adapter.callAttr("handle", bridge, line, sink)  // returns at once; requests run on Python threads
    }

    override fun close() {
        bridge.callAttr("close")
    }
}

// Usage:
//   val bridge = EdgeCloudBridge(ProcessTransport())
//   val (id, answer) = bridge.chat(listOf("user" to "Hello"), maxTokens = 128) { text -> runOnUiThread { view.append(text) } }
//   bridge.cancel(id)   // the user tapped Stop; answer fails with BridgeException(code = -32800)
