// EdgeCloudBridge.swift — the host side of the edgecloud bridge protocol (documentation; not built here).
//
// One JSON-RPC 2.0 object per line. Requests go out with a fresh integer id; a reader
// dispatches every line that comes back: `chat.delta` / `models.pull.progress` notifications
// by `params.id`, responses by `id`. The schema of every message: `edgecloud bridge schema`
// (generate Codable types from it; plain JSONSerialization keeps this sketch short).
//
// Two transports:
//   - ProcessTransport: macOS / Mac Catalyst, spawns `edgecloud bridge --stdio`.
//   - EmbeddedTransport: iOS, Python embedded in the app (PythonKit + a bundled Python),
//     calls `edgecloud.bridge.Bridge().handle(line, emit)` in-process.

import Foundation

public struct BridgeError: Error {
    public let code: Int          // -32602 invalid params (data.param names the field), -32800 cancelled, ...
    public let message: String
    public let data: [String: Any]?
}

public protocol BridgeTransport: AnyObject {
    /// Called with each line the bridge emits (on a background thread).
    var onLine: ((String) -> Void)? { get set }
    func send(_ line: String)
    func close()
}

public final class EdgeCloudBridge {
    public typealias Completion = (Result<[String: Any], BridgeError>) -> Void

    private struct Pending {
        let onNotification: ([String: Any]) -> Void
        let completion: Completion
    }

    private let transport: BridgeTransport
    private let lock = NSLock()
    private var nextId = 0
    private var pending: [Int: Pending] = [:]

    public init(transport: BridgeTransport) {
        self.transport = transport
        transport.onLine = { [weak self] line in self?.dispatch(line) }
    }

    /// Stream a chat: `onDelta` gets each piece of text, `completion` the final
    /// `{text, finish_reason, usage, route, cost}` (or error -32800 after `cancel`).
    @discardableResult
    public func chat(messages: [[String: String]], maxTokens: Int? = nil,
                     onDelta: @escaping (String) -> Void, completion: @escaping Completion) -> Int {
        var params: [String: Any] = ["messages": messages]
        if let maxTokens { params["max_tokens"] = maxTokens }
        return call("chat.create", params,
                     onNotification: { note in if let delta = note["delta"] as? String { onDelta(delta) } },
                     completion: completion)
    }

    /// Stop a running chat; its own completion then fails with code -32800.
    public func cancel(_ requestId: Int) {
        call("chat.cancel", ["id": requestId], completion: { _ in })
    }

    public func listModels(completion: @escaping Completion) {
        call("models.list", [:], completion: completion)
    }

    /// Answer `shutdown`, then let the transport go (a spawned bridge exits 0).
    public func shutdown() {
        call("shutdown", [:], completion: { [transport] _ in transport.close() })
    }

    @discardableResult
    public func call(_ method: String, _ params: [String: Any],
                     onNotification: @escaping ([String: Any]) -> Void = { _ in },
                     completion: @escaping Completion) -> Int {
        lock.lock()
        nextId += 1
        let id = nextId
        pending[id] = Pending(onNotification: onNotification, completion: completion)
        lock.unlock()
        let request: [String: Any] = ["jsonrpc": "2.0", "id": id, "method": method, "params": params]
        let data = try! JSONSerialization.data(withJSONObject: request)  // our own dictionaries: always valid
        transport.send(String(decoding: data, as: UTF8.self))
        return id
    }

    private func dispatch(_ line: String) {
        guard let object = try? JSONSerialization.jsonObject(with: Data(line.utf8)),
              let message = object as? [String: Any] else { return }
        if message["method"] != nil {  // a notification: params.id names the request
            guard let params = message["params"] as? [String: Any], let id = params["id"] as? Int else { return }
            lock.lock(); let entry = pending[id]; lock.unlock()
            entry?.onNotification(params)
            return
        }
        guard let id = message["id"] as? Int else { return }  // id null: a line we sent was not readable
        lock.lock(); let entry = pending.removeValue(forKey: id); lock.unlock()
        if let error = message["error"] as? [String: Any] {
            entry?.completion(.failure(BridgeError(code: error["code"] as? Int ?? -32603,
                                                   message: error["message"] as? String ?? "",
                                                   data: error["data"] as? [String: Any])))
        } else {
            entry?.completion(.success(message["result"] as? [String: Any] ?? [:]))
        }
    }
}

#if os(macOS) || targetEnvironment(macCatalyst)
/// Spawns `edgecloud bridge --stdio` (closing stdin cancels in-flight requests and ends it).
public final class ProcessTransport: BridgeTransport {
    public var onLine: ((String) -> Void)?
    private let process = Process()
    private let input = Pipe()
    private let output = Pipe()
    private var buffer = Data()

    public init(executable: URL, arguments: [String] = ["bridge", "--stdio"]) throws {
        process.executableURL = executable  // e.g. the app's bundled `edgecloud` or `python3 -m edgecloud`
        process.arguments = arguments
        process.standardInput = input
        process.standardOutput = output
        output.fileHandleForReading.readabilityHandler = { [weak self] handle in
            guard let self else { return }
            self.buffer.append(handle.availableData)
            while let newline = self.buffer.firstIndex(of: UInt8(ascii: "\n")) {
                let line = String(decoding: self.buffer[..<newline], as: UTF8.self)
                self.buffer.removeSubrange(...newline)
                self.onLine?(line)
            }
        }
        try process.run()
    }

    public func send(_ line: String) {
        input.fileHandleForWriting.write(Data((line + "\n").utf8))
    }

    public func close() {
        try? input.fileHandleForWriting.close()
    }
}
#endif

#if canImport(PythonKit)
import PythonKit

/// Python embedded in the app: the same protocol, in-process, no child process.
public final class EmbeddedTransport: BridgeTransport {
    public var onLine: ((String) -> Void)?
    private let bridge: PythonObject
    private var emit: PythonObject = Python.None

    public init(edgeModel: String) {
        bridge = Python.import("edgecloud.bridge").Bridge(edge_model: edgeModel)
        emit = PythonFunction { [weak self] (args: [PythonObject]) in
            self?.onLine?(String(args[0]) ?? "")
            return Python.None
        }.pythonObject
    }

    public func send(_ line: String) {
        bridge.handle(line, emit)  // returns at once; requests run on Python worker threads
    }

    public func close() {
        bridge.close()
    }
}
#endif

// Usage:
//   let bridge = EdgeCloudBridge(transport: try ProcessTransport(executable: edgecloudURL))
//   let id = bridge.chat(messages: [["role": "user", "content": "Hello"]], maxTokens: 128,
//                        onDelta: { text in DispatchQueue.main.async { label.text! += text } },
//                        completion: { result in print(result) })
//   bridge.cancel(id)   // the user tapped Stop
